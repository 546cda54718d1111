def main():\n    pass
