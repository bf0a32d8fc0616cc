"""Development helpers, never imported by a serving process: the tiny local model
(``tiny_model``), two regions on one host (``local_regions``) and ``serve deploy`` as our
commands run it (``serve_cli``)."""
