"""Starting the workers."""
