"""Ray Serve application serving an OpenAI-shaped API for Qwen3.6-35B-A3B.

Importing this package must stay cheap: the router replica, the CLI and the unit tests import it
without vLLM or torch.
"""
