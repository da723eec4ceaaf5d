"""Files and processes: atomic writes, content digests, the Hub, GPU slots per job, Snakemake's locks;
and how sizes and times are shown. Imports nothing else of core/."""
