"""pytest plugin (placeholder, wired properly with commspan.testing)."""
