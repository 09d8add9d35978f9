"""What differs by device type: the step loop's devices and each platform's streams."""
