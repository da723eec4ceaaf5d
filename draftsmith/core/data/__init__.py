"""The data files and prompts: prompt sources, chat rendering, benchmarks, the tokens file, hidden-state
shards and their manifest, the training loader, streamed states, the vocabulary map."""
