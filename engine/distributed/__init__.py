"""Running one model across several processes: tensor parallelism (tensor_parallel.py) over a
torch.distributed group of its own (group.py). The model-side slicing is engine/model/parallel.py."""
