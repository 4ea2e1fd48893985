"""Whether two .npz files of bfl_same.py (or session 14's per_client_same_results.py) hold the same leaves, bitwise.
python compare_npz.py A.npz B.npz"""
import sys
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
print(len(a.files), "leaves, same names:", sorted(a.files) == sorted(b.files), "; all bitwise equal:",
      all(np.array_equal(a[k], b[k]) for k in a.files))
