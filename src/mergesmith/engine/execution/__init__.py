"""Running a Plan: the local executor's parts (memory admission, computing a recipe, writing and journaling),
the Ray executor, the input feed that reads ahead of the workers, row blocks, recipe operations and the
NaN/inf monitor."""
