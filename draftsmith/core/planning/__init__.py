"""Before any job runs: the GPU memory plan, where training gets its hidden states, extraction's size and
time estimates, and the pre-flight's drafter costs."""
