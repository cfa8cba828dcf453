"""Property tests, stateful fuzz, planted bugs and the mutation catalogue."""
