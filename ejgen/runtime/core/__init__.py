"""Runtime pieces every family shares: settings, kernel sets and choice, block-range arithmetic."""
