"""``dartree bench``: the published evaluation protocol on CPU-sized runs, with peers and a report."""
