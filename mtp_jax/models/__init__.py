"""Model families and the registry mapping an architecture to its modules."""
