"""Model-free tests of the engine layer: output processing and beam search."""
