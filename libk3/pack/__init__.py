"""The pack stage (formats/pack.md): writing a pack (``writer``, ``compress``), its schema and
readers (``schema``), and the non-finite scan of what it copies (``nonfinite``)."""
