"""``rolloutd demo``, and the small models it and the tests build locally."""
