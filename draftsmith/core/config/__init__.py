"""The configuration: its schema and defaults, the config files and their checks (config.py), the
settings classes built from the schema (settings.py), every command's settings (stage_settings.py) and
its paths (stage_args.py). Torch-free: the Snakefile imports it at every parse."""
