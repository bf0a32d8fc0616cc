"""What a serving process (a router or a model replica) does to its own interpreter once it has
started: its start-up heap out of the garbage collector's reach (``heap.py``)."""
