"""What a notebook user touches: the magics, the run's widget and its lasting text."""
