from kvlease.cli import main

main()
