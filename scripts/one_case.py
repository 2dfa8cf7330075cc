import sys
sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
from quick_gpu import check  # noqa: E402
args = [int(a) if a.lstrip('-').isdigit() else a for a in sys.argv[1:]]
b, H, Hkv, D, L, dtype = args[:6]
splits = None if len(args) < 7 or args[6] == "auto" else int(args[6])
print(check(b, H, Hkv, D, L, dtype, splits))
