"""What a compiled step runs (`report`) and how values fit low-precision formats."""
