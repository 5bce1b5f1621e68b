from lmc.cli import main

main()
