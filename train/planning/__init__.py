"""Planning before a run: the memory estimate, the all-to-all cost model and the dry run that uses both."""
