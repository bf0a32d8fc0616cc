"""How our processes run: the CPUs they keep to (``cpus.py``), a serving process's start-up heap out
of the garbage collector's reach (``heap.py``), and what a Ray node started on this machine runs
beside Serve (``local_ray.py``)."""
