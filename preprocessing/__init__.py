"""PUMS person files -> cleaned, encoded, shuffled HDF5 (``mpidp prep``)."""
