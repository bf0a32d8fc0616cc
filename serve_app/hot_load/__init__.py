"""Hot-load, in one room: a model's wanted and actual state (``state``), the router's cached
view of it and of each model's load (``tracker``), and the Serve autoscaling policy that turns a
wanted state into replicas (``autoscaling``)."""
