"""The test suite; its folders mirror the package (docs/design.md, "Map of the house")."""
