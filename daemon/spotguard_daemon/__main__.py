"""``python -m spotguard_daemon``: the same as the ``spotguard`` command."""

from spotguard_daemon.commands.cli import main

if __name__ == "__main__":
    main()
