"""kvheat.server"""
