"""The doctor stage: the machine probe (``probe``: memory, CPU, disks; no kernels, no model)
and k3-doctor's report (``report``: can this machine run this model, with which preset)."""
