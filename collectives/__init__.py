"""All-reduce algorithms over mpi4py and their micro-benchmark."""
