"""opake_compile: differentially private training for PyTorch as a compiler transform."""
