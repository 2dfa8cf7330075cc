from cupydecode.cli import main

main()
