"""Development helpers, never imported by a serving process: the tiny local model
(``tiny_model``) and two regions on one host (``local_regions``)."""
