"""Which model versions an application serves, and loading or unloading them at run time."""
