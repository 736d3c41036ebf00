"""The trust rounds: hostile files, hostile neighbours and killed owners, across parts."""
