"""Feed-forward blocks (the lead merges this package marker with the feed-forward registry)."""
