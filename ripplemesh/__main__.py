from ripplemesh.cli import main

main()
