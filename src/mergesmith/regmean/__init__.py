"""RegMean's data side: the Gram matrices of every merged linear layer's inputs, collected by running each model on a
calibration text before the merge (the math is methods/regmean.py).

registration.py plugs the step into the engine (engine/extensions.py); planning.py checks the config and points the
linear weights' recipes at the Grams; collect.py runs the models (layer by layer for the llama family) and writes
the Grams, one file per layer, into the output directory's state (store.py), so a rerun reuses finished layers.
"""
