"""Write ssdsgd/worker/digits_split.txt: the rows of scikit-learn's digits that its stratified 80/20 split
(train_test_split(..., test_size=0.2, random_state=0, stratify=target)) puts in the training and test sets,
in the order it returns them. The workers read that file instead of importing scikit-learn for the split
(docs/design.md, "The code, folder by folder"); tests/unit/test_data.py checks it against scikit-learn's split.

    python scripts/digits_split.py
"""
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: ssdsgd from this checkout
from ssdsgd.worker.small_sets import DIGITS_SPLIT_FILE  # noqa: E402


def sklearn_split():
    """(train rows, test rows) as scikit-learn's split orders them."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    target = load_digits().target
    train, test = train_test_split(np.arange(target.size), test_size=0.2, random_state=0, stratify=target)
    return train, test


def main():
    import sklearn
    train, test = sklearn_split()
    with open(DIGITS_SPLIT_FILE, "w") as f:
        f.write("# scikit-learn's digits: train_test_split(test_size=0.2, random_state=0, stratify=target), "
                f"scikit-learn {sklearn.__version__}\n# written by scripts/digits_split.py; rows of digits.csv.gz\n")
        for name, rows in (("train", train), ("test", test)):
            f.write(f"{name} " + " ".join(map(str, rows)) + "\n")
    print(DIGITS_SPLIT_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
