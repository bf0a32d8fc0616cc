"""The fault suite (``serve-app faults``): overload, disconnects, an engine-core kill, a soak,
fuzzing and a graceful redeploy against a running service on this machine, with figures.

Every loop is bounded in count and time, and traffic goes to loopback only (``check_local``).
docs/reliability.md says what the system promises and shows the figures this prints.
"""
