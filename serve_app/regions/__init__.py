"""Regions: the schema of ``regions/<id>.yaml`` (``schema``), the Serve config rendered from it
(``serve_config``), the Terraform inputs and roots (``render``), and ``serve-app regions``
(``cli``)."""
