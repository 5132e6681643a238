"""Model definition and weight loading."""
