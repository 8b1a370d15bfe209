"""``crosskd serve``: the teacher answering top-K signals online over HTTP."""
