"""Input validation that no single reader owns: parameter values against their methods' ranges, and the
non-finite values a merge streams through (see README, "Input validation")."""
