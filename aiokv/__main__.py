"""``python -m aiokv``: the ``aiokv`` command, run as the console script runs it
(:func:`aiokv._console.main`: the install hint when the ``cli`` extra is missing)."""

from ._console import main

if __name__ == "__main__":
    main()
