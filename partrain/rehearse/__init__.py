"""`partrain rehearse`: the user's layout against one process, on CPU, before the GPU hours."""
