"""libk3: the library behind the k3 tools (k3-doctor, k3-pack, k3-run, k3-trace).

Layers, imported one way only (front end -> engine -> model/stream -> kernels/io):

* ``libk3.io``      config, safetensors shards, checkpoint index, tokenizer.
* ``libk3.kernels`` numba kernels: arrays in, arrays out, no I/O.
* ``libk3.model``   the K3 forward pass (model.md §5), no I/O.
* ``libk3.synth``   synthetic checkpoints in the released layout.
"""

__version__ = "0.1.0"
