"""The machine room: what this computer offers a run, read the way k3 uses it.

* ``cgroup``  the cgroup v1/v2 limits on this process (memory, CPU quota).
* ``cpus``    the CPUs this process may use, their ISA flags, and what else runs on them.
* ``threads`` the kernels' thread team, set up before numba loads (count, wait policy,
  threading layer), and what numba actually runs with.
* ``memory``  memory a run can count on (MemAvailable and the cgroup limit).
* ``storage`` per directory: filesystem, free space, O_DIRECT, read rates, probe files.

Nothing here imports a kernel or the model; only ``threads`` and ``parallel`` touch
numba, and ``threads.configure`` must run before anything imports it.
"""
