"""The trace stage (formats/trace.md): the file format (``format``), replaying expert-cache
policies over a trace (``replay``), reports (``report``) and budget sizing (``sizing``)."""
