"""`python -m s4r_cli`: the same as the `s4r` command."""

from s4r_cli.app import main

if __name__ == "__main__":
    main()
