"""The GPU step rehearsed on CPU: the production Learner on fake CUDA devices in a fake world of the
config's size, with memory and FLOPs counted (`python -m gspo_mcore.rehearse`). The production code
does not know: the fake devices (device.py, fake_cuda.cpp), the fake world (world.py), the dispatch
mode (mode.py), the routing plan for the host reads (plan.py) come from outside; what each answers
in place of the hardware is listed in step.py's docstring. Nothing here is imported by a training
process."""
