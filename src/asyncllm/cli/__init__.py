"""The `asyncllm` command line (main.py) and its flags from dataclasses (args.py)."""
