"""The supervised warm start's command line (hexrl.train.warm_start): `python tools/warm_start.py OUT_DIR`;
--help lists its options."""
from hexrl.train.warm_start import main

if __name__ == "__main__":
    main()
